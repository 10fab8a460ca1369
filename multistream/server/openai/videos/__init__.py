"""OpenAI's Videos API (``/v1/videos``): ``protocol`` (the bodies), ``serving`` (events -> the job
object and its assets, without a server) and ``router`` (the routes)."""
