"""What runs a group's collectives: the dispatch path, the jobs, the engine, the state, staging."""
