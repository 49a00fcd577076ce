"""The engine: the scheduler and its step, a request's state, the KV manager and sizing, the prefix cache, the target
backend, and the offline in-process `llm.SpeculativeEngine`. Import from the modules."""
