"""The process group torch sees: its surface, the argument checks, the dynamo boundary."""
