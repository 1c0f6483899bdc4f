"""`tailrace check URL`: tell any OpenAI-compatible server's streaming bugs, check by check."""
