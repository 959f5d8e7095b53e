"""The tokenizer service (TokenizerService over gRPC): `folio tokenizer`."""
