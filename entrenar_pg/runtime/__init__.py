"""What runs a group's collectives: the runtime, the jobs, the engine, the state, staging."""
