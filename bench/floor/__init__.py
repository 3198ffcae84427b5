"""Echo servers below the bare ones (bench/protocol_floor.py): what the protocol layers under
aiohttp's web framework and grpc.aio's generated servicer cost."""
