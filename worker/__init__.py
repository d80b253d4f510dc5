"""kvrail.worker"""
