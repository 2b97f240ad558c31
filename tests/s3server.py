"""A real S3-compatible server for the tests: moto's standalone server on 127.0.0.1, behind a TCP proxy that a test can stop and start.

The server runs in its own process (`moto_server`), with authentication on: the first requests create an IAM user and its access key,
every later request must be signed with that key, so a wrong key is refused as S3 refuses it. Clients talk to the proxy; stopping
the proxy makes the store unreachable (connections refused) while the server keeps its objects, and starting it again brings the
same objects back.
"""
import json, os, signal, socket, subprocess, sys, time, urllib.request
from pathlib import Path
import boto3

TESTS = Path(__file__).parent

def free_port()->int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

def _wait_ready(p, url, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None: raise RuntimeError(f"{p.args} exited with {p.returncode}")
        try: return urllib.request.urlopen(url, timeout=1)
        except OSError: time.sleep(0.05)
    raise RuntimeError(f"{p.args} did not answer {url} within {timeout}s")

class S3Server:
    "moto's S3 on 127.0.0.1 behind a proxy; `env` and `options` reach it as a user would, with a valid key"
    bucket = 'runs'
    def __init__(self):
        self.port,self.proxy_port = free_port(),free_port()
        moto = Path(sys.executable).parent/'moto_server'
        self.server = subprocess.Popen([str(moto), '-H', '127.0.0.1', '-p', str(self.port)], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, env=dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT='4'),
                                       start_new_session=True)
        self.proxy = None
        try:
            _wait_ready(self.server, f'http://127.0.0.1:{self.port}/moto-api/')
            self.key,self.secret = self._make_key()
            self.start()
            self.client().create_bucket(Bucket=self.bucket)
        except BaseException:
            self.close()
            raise

    def _make_key(self):
        "The IAM user the tests act as (the server counts these requests among its first unauthenticated ones)"
        iam = boto3.client('iam', endpoint_url=f'http://127.0.0.1:{self.port}', region_name='us-east-1',
                           aws_access_key_id='bootstrap', aws_secret_access_key='bootstrap')
        iam.create_user(UserName='trainer')
        iam.put_user_policy(UserName='trainer', PolicyName='all', PolicyDocument=json.dumps(
            {'Version': '2012-10-17', 'Statement': [{'Effect': 'Allow', 'Action': '*', 'Resource': '*'}]}))
        k = iam.create_access_key(UserName='trainer')['AccessKey']
        return k['AccessKeyId'],k['SecretAccessKey']

    @property
    def endpoint(self)->str: return f'http://127.0.0.1:{self.proxy_port}'
    @property
    def env(self)->dict:
        "The environment through which botocore in a training script finds the server and the key"
        return dict(AWS_ACCESS_KEY_ID=self.key, AWS_SECRET_ACCESS_KEY=self.secret, AWS_ENDPOINT_URL=self.endpoint,
                    AWS_DEFAULT_REGION='us-east-1', AWS_EC2_METADATA_DISABLED='true')
    def options(self, **kwargs)->dict:
        "Storage options for s3fs in this process: the endpoint and the key, quick to give up when unreachable"
        return dict(key=self.key, secret=self.secret, client_kwargs=dict(endpoint_url=self.endpoint, region_name='us-east-1'),
                    config_kwargs=dict(connect_timeout=2, read_timeout=10, retries={'max_attempts': 1}), skip_instance_cache=True, **kwargs)

    def client(self):
        "A boto3 client that talks to the server directly (not through the proxy), for the tests to look at and damage objects"
        return boto3.client('s3', endpoint_url=f'http://127.0.0.1:{self.port}', region_name='us-east-1',
                            aws_access_key_id=self.key, aws_secret_access_key=self.secret)

    def keys(self, prefix)->list:
        return sorted(o['Key'] for o in self.client().list_objects_v2(Bucket=self.bucket, Prefix=prefix).get('Contents', []))

    def start(self):
        "Start the proxy: the server is reachable"
        self.proxy = subprocess.Popen([sys.executable, str(TESTS/'tcpproxy.py'), str(self.proxy_port), str(self.port)],
                                      stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert self.proxy.stdout.readline().strip() == 'READY', "the proxy did not start"

    def stop(self):
        "Stop the proxy: connections are refused, the objects stay on the server"
        if self.proxy is None: return
        self.proxy.kill()
        self.proxy.wait(10)
        self.proxy = None

    def close(self):
        self.stop()
        self.server.send_signal(signal.SIGKILL)
        self.server.wait(10)
