"""The step and what guards it: each rank's batches (in the loop, loader processes, Ray Datasets),
the learning-rate schedule, precision phases, the step's variants (steps.py: one interface, chosen
by the layout), the loop that streams reports (loop.py), non-finite steps, out of memory, the stop
agreement, gradient checks, evaluation, profiling, per-step timings."""
