"""Operator actions, shared by the CLI and the dashboard: replay, resume, dismiss, cancel, in bulk."""
