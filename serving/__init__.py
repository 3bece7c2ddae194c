"""After training: a run's model made smaller (structured pruning, int8 weights), exported to an
inference format (ONNX, a torch.export program) and checked there against eager PyTorch, and
served on Ray Serve with adaptive batching, warm-up and a canary version.

source.py    the run's model with its trained weights, its data and its eval metric
compress.py  l1-structured pruning (really smaller Linear layers), int8 weights, fine-tuning as a run
artifact.py  export to ONNX / torch.export, load either back, check against eager, measure
server.py    the Ray Serve application behind `gearshift serve`
"""
