"""Helpers shared by the test folders: processes, publishers, the HF oracle, engines."""
