"""Frontend processes (`--frontend-processes N`): the channel, the server side, the worker."""
