"""The node: asyncio server, connections, membership, accounting, identity; and a client."""
