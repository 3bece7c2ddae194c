"""Pipeline parallelism: where the model is cut (cut.py), a stage made from the whole model
(stage.py), and the layout that runs the stages under a schedule (parallel.py)."""
