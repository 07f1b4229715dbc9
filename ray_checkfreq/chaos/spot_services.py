"""What a local spot cluster has beside Ray: S3 (moto) and the instance metadata stand-in.

    python -m ray_checkfreq.chaos.spot_services --s3-port P --imds-port Q --bucket B --ready FILE

Serves both on 127.0.0.1 until it is killed; writes ``FILE`` once both answer (and the
bucket exists). ``spot_cluster.up`` starts it with the cluster's marker in its
environment, so ``down`` stops it with everything else of the cluster.
"""

from __future__ import annotations

import argparse
import signal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--s3-port", type=int, required=True)
    parser.add_argument("--imds-port", type=int, required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--ready", required=True, help="a file written once both serve")
    args = parser.parse_args()

    import boto3
    from moto.server import ThreadedMotoServer

    from ray_checkfreq.chaos.imds import MetadataService

    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=args.s3_port, verbose=False)
    s3.start()
    MetadataService(port=args.imds_port).start()
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{args.s3_port}").create_bucket(Bucket=args.bucket)
    with open(args.ready, "w") as ready:
        ready.write("ready\n")
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
