class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be read: truncated, corrupt, or missing. The message names the file."""
