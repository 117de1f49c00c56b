"""The process group torch sees: its surface (process_group.py), the request checks, the Work."""
