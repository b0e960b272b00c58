"""The ``ditbook`` command's subcommands, one module per stage package it drives (each defines
``register(subparsers)``); ``ditbook.cli`` adds them. Drivers: they may import any stage."""
