"""Helpers every test folder uses: processes on a local gloo group, tiny models of each family, the demo's training
run shrunk to seconds."""
