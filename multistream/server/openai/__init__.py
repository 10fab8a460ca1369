"""The OpenAI-compatible surface, one folder per endpoint as vLLM's ``entrypoints/openai/<endpoint>``:
``protocol.py`` (the pydantic bodies and their conversion into a family's options), ``serving.py``
(a pure translator from a stream's events to the endpoint's chunks, testable without a server) and
``router.py`` (the routes). ``chat`` (with the audio chat), ``completions``, ``responses``,
``images``, ``audio`` (speech), and ``models``. Independent of the native surface (`server.native`)."""
