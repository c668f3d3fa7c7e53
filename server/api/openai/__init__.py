"""OpenAI's API as vLLM serves it: ``protocol`` (requests and responses), ``chat`` (rendering
messages and tools with the chat template), ``tools`` (tool-call formats: prompts, grammars,
parsers), ``serving`` (what completions and chat share), ``router``."""
