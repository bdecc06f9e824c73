"""Example tasks for `run-engine dev`."""
