"""Shared memory between the ranks of one host: byte rings, slot areas, their set-up."""
