"""The local lab: real systemd nodes (systemd-nspawn) on one machine, the test bed and the demo target."""
