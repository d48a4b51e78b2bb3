BEGIN TRANSACTION;
CREATE TABLE admin_audit (
	id INTEGER NOT NULL, 
	at FLOAT NOT NULL, 
	action VARCHAR(32) NOT NULL, 
	params TEXT NOT NULL, 
	result TEXT NOT NULL, 
	actor VARCHAR(64) NOT NULL, 
	PRIMARY KEY (id)
);
INSERT INTO "admin_audit" VALUES(1,1700000100.0,'flush','{"tier": "all"}','{"l1": 3}','token:abcd');
CREATE TABLE request_log (
	id INTEGER NOT NULL, 
	at FLOAT NOT NULL, 
	task VARCHAR(16) NOT NULL, 
	tier VARCHAR(16), 
	latency_ms FLOAT NOT NULL, 
	status VARCHAR(16) NOT NULL, 
	error_code VARCHAR(64), 
	key_digest VARCHAR(32), 
	model_version VARCHAR(64) NOT NULL, 
	generation INTEGER NOT NULL, 
	top_label VARCHAR(128), 
	model_ms FLOAT, 
	route VARCHAR(16), 
	PRIMARY KEY (id)
);
INSERT INTO "request_log" VALUES(1,1700000000.0,'image','miss',1.5,'ok',NULL,'0000000000000000','abc123',0,'tabby',12.0,'gradio');
INSERT INTO "request_log" VALUES(2,1700000030.0,'text','l1',2.5,'ok',NULL,'0101010101010101','abc123',0,'refund',NULL,'rest');
INSERT INTO "request_log" VALUES(3,1700000060.0,'image','l2',3.5,'ok',NULL,'0202020202020202','abc123',0,NULL,NULL,'gradio');
INSERT INTO "request_log" VALUES(4,1700000090.0,'text','coalesced',4.5,'ok',NULL,'0303030303030303','abc123',0,'espresso',NULL,'gradio');
INSERT INTO "request_log" VALUES(5,1700000120.0,'image','miss',5.5,'ok',NULL,'0404040404040404','abc123',0,'greeting',12.0,'gradio');
INSERT INTO "request_log" VALUES(6,1700000150.0,'text',NULL,6.5,'error','model_error','0505050505050505','abc123',0,NULL,NULL,'gradio');
CREATE TABLE schema_version (
	id INTEGER NOT NULL, 
	version INTEGER NOT NULL, 
	PRIMARY KEY (id)
);
INSERT INTO "schema_version" VALUES(1,3);
CREATE INDEX ix_request_log_key ON request_log (key_digest);
CREATE INDEX ix_request_log_at ON request_log (at);
COMMIT;
