"""Who may call the server and what it reports about itself: API keys and principals (`keys`), the
WebSocket ``Origin`` and ``Host`` checks (`origins`), the middleware that applies them with the
connection cap and request ids (`middleware`), keys kept out of the logs (`redaction`), and the
Prometheus metrics (`metrics`)."""
