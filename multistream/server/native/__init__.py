"""The native surface: ``/v1/text``, ``/v1/image``, ``/v1/speech`` (SSE of wire events), resume,
status, cancel and edits of a stream (`routes`: the family routes come from `families.FAMILIES`), the WebSocket (`websocket`) and health,
metrics and the web client (`health`). Independent of the OpenAI surface (`server.openai`)."""
