"""HTTP plumbing every surface shares: reading a body, the error table, SSE frames, problems, disconnects.

Imports no route package (`native`, `openai`): they build on it.
"""
