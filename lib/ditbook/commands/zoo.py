"""``ditbook zoo list`` and ``ditbook zoo build NAME DIR``."""

from __future__ import annotations

from pathlib import Path


def cmd_zoo(args) -> int:
    from ..zoo import build, configs, list_models

    if args.zoo_command == "list":
        for name in list_models():
            spec = configs[name]
            print(f"{name:12s} {spec.pipeline_class} + {spec.transformer_class}  {spec.notes}")
        return 0
    if args.name not in list_models():
        print(f"ditbook zoo: unknown model {args.name!r}; choose one of {', '.join(list_models())}")
        return 2
    card = build(args.name, Path(args.dir))
    print(f"built {args.name}: card {card}")
    print(f"run it with: ditbook run {card}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("zoo", help="tiny random-initialized test models: list, build")
    sub = p.add_subparsers(dest="zoo_command", required=True)
    sub.add_parser("list", help="the models the zoo can build")
    b = sub.add_parser("build", help="build one model with save_pretrained into DIR, with its card")
    b.add_argument("name", help="a model name from 'ditbook zoo list'")
    b.add_argument("dir", help="folder to write the model and its card into")
    p.set_defaults(func=cmd_zoo)
