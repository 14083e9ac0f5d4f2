"""``agentrl sandbox setup | gc``: engine + base image setup, and removal of orphaned sandboxes."""

from __future__ import annotations

import argparse
import logging
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentrl sandbox", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    setup = sub.add_parser("setup", help="install docker.io/debootstrap/bubblewrap, start dockerd, build the image")
    setup.add_argument("--image", default=None, help="image tag to build (default agentrl-sandbox:py3)")
    setup.add_argument("--no-build", action="store_true", help="only install and start the engine")
    gc = sub.add_parser("gc", help="remove containers and volumes labelled by agentrl")
    gc.add_argument("--older-than", type=float, default=0.0, metavar="SECONDS",
                    help="only remove sandboxes created more than this many seconds ago")
    gc.add_argument("--all-owners", action="store_true",
                    help="also remove sandboxes whose owning process is still alive")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "setup":
        from agentrl.sandbox.engine_setup import DEFAULT_IMAGE, SetupError, setup

        try:
            done = setup(args.image or DEFAULT_IMAGE, build=not args.no_build)
        except (SetupError, OSError) as exc:
            print(f"agentrl sandbox setup: {exc}", file=sys.stderr)
            return 1
        except Exception as exc:  # subprocess.CalledProcessError and friends
            print(f"agentrl sandbox setup failed: {exc}", file=sys.stderr)
            return 1
        print(f"engine ready; image {done['image']}: {'built' if done['built_image'] else 'present'}; "
              f"installed: {', '.join(done['installed']) or 'nothing'}; "
              f"dockerd {'started' if done['started_dockerd'] else 'already running'}")
        return 0
    from agentrl.sandbox.gc import collect_garbage

    removed = collect_garbage(older_than_s=args.older_than, only_dead_owners=not args.all_owners)
    print(f"removed {removed['containers']} containers, {removed['volumes']} volumes, "
          f"{removed['dirs']} bubblewrap work dirs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
