"""The runtime above the engine: planner, voices, job pipeline, codec stage and the engine thread."""
