"""The emulated accelerator, for testing device code without a GPU (docs/device-emulation.md).

`peerflow conformance NAME --emulate-device` runs an engine's conformance suite on it;
`PEERFLOW_EMULATE_ACCELERATOR=1` puts every process of a run on it, through torch's
device-extension hook (`autoload`). Nothing in PeerFlow's production code imports this
package.
"""
