from shardstack.cli import entry

entry()
