"""Structured output: grammar-constrained decoding (llguidance, `grammar`) and closing a JSON
answer validly within its token budget (`closing`, over the closer's reading of the schema in
`closing_schema`, `json_closing` and `regex_closing`)."""
