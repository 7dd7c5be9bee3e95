"""System tests: real models, child processes, `kvstore serve` and Redis servers."""
