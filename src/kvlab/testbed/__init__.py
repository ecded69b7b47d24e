"""The VM testbed: a pinned, reproducible image and two qemu VMs provisioned by the real roles."""
