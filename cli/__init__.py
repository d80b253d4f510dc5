"""The `kvrail` command line: `kvrail up`, `status`, `config`, `model prepare`, `version`."""
