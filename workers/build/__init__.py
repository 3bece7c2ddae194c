"""Building the model a worker trains: the job's components (model, loss, optimizer, tensor-parallel
plan), the built-in models, the first build on the meta device and its replay, model.init's
per_shard values, model.pretrained's weights by slices and the Hugging Face names, activation
checkpointing; the builder that lays a model out and switches it (builder.py)."""
