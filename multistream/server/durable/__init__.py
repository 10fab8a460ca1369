"""What outlives a server process: the shared event log (`event_log`), image checkpoints
(`checkpoints`), the restart continuation (`continuation`) and the one resume path it shares with
the Ray failover (`resume`). The only server package that spells a Redis key or imports `redis`."""
