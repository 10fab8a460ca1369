"""OpenAI `images` endpoint: protocol (bodies), serving (events to chunks), router (routes)."""
