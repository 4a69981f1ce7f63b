"""Test support that ships with PeerFlow: an emulated accelerator (`emulated_device`)."""
