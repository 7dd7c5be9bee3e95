"""Long runs that are not tests, each with its committed figures in a ``results/`` folder
beside it: the fault harness (``faults``) and the model-family survey (``families``)."""
