"""The OpenAI-compatible API over the engine: request bodies (openai_protocol), chat templates
and tool calls, completions and chat completions, their choices and streamed chunks, the
tokenize routes and the batch file runner. Nothing here runs the model; it calls the engine."""
