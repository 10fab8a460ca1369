"""Who may call the server and what it reports about itself: API keys, origins (CORS), allowed hosts,
log redaction (`security`), and the Prometheus metrics (`metrics`)."""
