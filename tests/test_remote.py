"""Resume points on a real S3-compatible server (moto's, on 127.0.0.1, started and stopped here), through s3fs.

The store alone: a round trip, an interrupted upload, damaged objects, wrong credentials, an unreachable server."""
import pytest, torch
from resumable_train.files import CheckpointError
from resumable_train.store import FsspecStore, StoreError, MANIFEST, as_store
from s3server import S3Server

@pytest.fixture(scope='module')
def s3():
    server = S3Server()
    yield server
    server.close()

CK = {'model': {'w': torch.arange(6.)}, 'opt': {'state': [], 'hypers': []}}

def test_store_round_trip(s3):
    "Save writes the data, then the manifest; damaged or incomplete objects do not load, and say why, naming the URL"
    url = f's3://{s3.bucket}/store/run1'
    st = FsspecStore(url, **s3.options())
    assert st.ls() == []
    st.save(CK, 'a-0001.pth')
    assert s3.keys('store/run1/') == ['store/run1/a-0001.pth', 'store/run1/a-0001.pth' + MANIFEST]
    assert torch.equal(st.load('a-0001.pth')['model']['w'], CK['model']['w'])
    c = s3.client()
    data = c.get_object(Bucket=s3.bucket, Key='store/run1/a-0001.pth')['Body'].read()
    c.put_object(Bucket=s3.bucket, Key='store/run1/a-0002.pth', Body=data)
    assert [(e.name, e.complete) for e in st.ls()] == [('a-0001.pth', True), ('a-0002.pth', False)]
    with pytest.raises(CheckpointError, match=f'{url}/a-0002.pth has no manifest'): st.load('a-0002.pth')
    c.put_object(Bucket=s3.bucket, Key='store/run1/a-0001.pth', Body=data[:-100])
    with pytest.raises(CheckpointError, match=f'{url}/a-0001.pth is {len(data)-100:,} bytes but its manifest says {len(data):,}'): st.load('a-0001.pth')
    st.remove('a-0001.pth'); st.remove('a-0002.pth')
    assert s3.keys('store/run1/') == []

def test_wrong_credentials(s3):
    "A key the server does not know: listing and writing raise at once, naming the URL and the cause"
    url = f's3://{s3.bucket}/store/creds'
    st = FsspecStore(url, **dict(s3.options(), key='AKIAWRONGWRONGWRONG0', secret='wrong'))
    with pytest.raises(StoreError, match=f'Could not list {url}: access refused .*check the credentials'): st.ls()
    with pytest.raises(StoreError, match=f'Could not write {url}/a-0001.pth: access refused'): st.save(CK, 'a-0001.pth')
    assert s3.keys('store/creds/') == []

def test_missing_bucket(s3):
    st = FsspecStore('s3://no-such-bucket/run1', **s3.options())
    with pytest.raises(StoreError, match='Could not write s3://no-such-bucket/run1/a-0001.pth: not found'): st.save(CK, 'a-0001.pth')

def test_unreachable(s3):
    "The server stops: a write retries, then raises naming the URL; the earlier checkpoint is intact when it is back"
    url = f's3://{s3.bucket}/store/down'
    st = as_store(url, retries=2, backoff=0.05, **s3.options())
    st.save(CK, 'a-0001.pth')
    s3.stop()
    try:
        with pytest.raises(StoreError, match=f'Could not write {url}/a-0002.pth: EndpointConnectionError.*gave up after 3 attempts'):
            st.save(CK, 'a-0002.pth')
        with pytest.raises(StoreError, match=f'Could not list {url}'): st.ls()
    finally: s3.start()
    assert [(e.name, e.complete) for e in st.ls()] == [('a-0001.pth', True)]
    assert torch.equal(st.load('a-0001.pth')['model']['w'], CK['model']['w'])
