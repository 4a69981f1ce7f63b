"""The switch of the emulated accelerator, read by its torch hook and by `install_from_env`."""

#: Set to "1" in a process's environment (a run's, a test's, `peerflow conformance
#: --emulate-device`'s) to make every PeerFlow process of it compute on the emulated device.
ENV_VAR = "PEERFLOW_EMULATE_ACCELERATOR"
