"""The engine service (EngineService over gRPC): `folio engine`."""
