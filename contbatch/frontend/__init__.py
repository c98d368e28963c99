"""Clients of the engine: the engine thread, output processing, the synchronous and asyncio clients."""
