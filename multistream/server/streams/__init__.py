"""The streams a server holds, whatever surface opened them: the registry of running and recent
streams (`registry`), the `StreamView` both local and remote records implement (`view`), edits of a
running stream (`edits`), admission and its queue (`admission`), the content filter (`filtering`),
the gate that makes a demo's model go through all of it (`gated`), the queued requests whose
client already holds their id (`waiting`), and a model's stream started off the event loop
(`starting`). Knows no route package."""
