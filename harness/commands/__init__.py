"""The command line: argument parsing, each command handing over to the layers below."""
