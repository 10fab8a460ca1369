"""The streams a server holds, whatever surface opened them: the registry of running and recent
streams (`registry`), the `StreamView` both local and remote records implement (`view`), edits of a
running stream (`edits`), admission and its queue (`admission`), the content filter (`filtering`)
and the gate that makes a demo's model go through all of it (`gated`). Knows no route package."""
