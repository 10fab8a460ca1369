"""OpenAI `audio` endpoint: protocol (bodies), serving (events to chunks), router (routes)."""
