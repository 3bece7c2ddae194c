"""A worker's state on disk: checkpoints (the full and the sharded DCP formats, written behind the
steps or in them), where they live (folders, fsspec URLs, the driver's folder served), the digests
taken as files are written, final.pt and exports a tensor at a time, and StateIO, what a worker
writes and reads."""
