"""Engine control: local processes, systemd units (the lab), containers from the serving image."""
